"""The operating system and systemd: listeners, socket activation, notify, peer credentials,
hang-ups, logs.
"""
