"""Every setting declared once: the file, environment and flags, model specs."""
