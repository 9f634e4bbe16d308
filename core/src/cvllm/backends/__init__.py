"""Hardware backends. The CPU backend is built in; others (cuda, metal) are plugins."""
