"""The router's edge: the OpenAI HTTP surface, request parsing, SSE, and the upstream client."""
