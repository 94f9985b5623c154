"""`kvroute demo`: cache-aware routing against round robin on a simulated fleet."""
