"""Hardware backends. The CPU backend is built in; others (cuda, ...) are plugins."""
