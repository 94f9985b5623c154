"""Operating the router: admin API, metrics, decision log, dashboard, `kvroute inspect`."""
