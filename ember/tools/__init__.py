"""User-facing tools: explain, the demo, the CLI."""
