"""The engine in a process of its own, as ``cvserve`` runs it: the API process's client (``client``), the
child's loop around the engine (``process``), the msgspec messages between them (``messages``) and the child's
light entry point (``entry``)."""
