"""The `kvroute` console command (subcommands live in their components)."""
