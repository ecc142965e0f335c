"""llama-server's own routes: /completion, slots, extras, timings."""
