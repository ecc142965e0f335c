"""meshd's subcommands and the server they start (serve, demo, worker, plugins, config)."""
