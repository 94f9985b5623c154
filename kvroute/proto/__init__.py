"""The wire contract between bridge and router: `events.proto` and its generated Python."""
