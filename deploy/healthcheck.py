"""Container health probe: exit 0 if GET $KVROUTE_HEALTH_URL answers 2xx within 2 s.

The slim base image has no curl; Python is there anyway. Kubernetes uses its own HTTP
probes (see the Helm chart); this is for `docker run` and Compose.
"""

import os
import sys
import urllib.request

url = os.environ.get("KVROUTE_HEALTH_URL", "http://127.0.0.1:8000/health")
try:
    with urllib.request.urlopen(url, timeout=2) as response:
        sys.exit(0 if 200 <= response.status < 300 else 1)
except Exception as err:  # any failure is "unhealthy"
    print(f"unhealthy: {url}: {err}", file=sys.stderr)
    sys.exit(1)
