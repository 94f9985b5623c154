"""Choosing a worker: the index view, the policy and its cost, session hashing."""
