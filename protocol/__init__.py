"""meshd.protocol: the versioned wire contract between meshd and local tools and plugins."""
