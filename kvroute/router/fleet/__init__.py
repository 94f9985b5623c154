"""The fleet as the router sees it: workers, health, load, KV-event subscriptions, discovery."""
