"""The engine in a process of its own, as ``cvserve`` runs it: the API process's client (``client``) and its
requests' streams (``stream``), the child's loop around the engine (``process``), the msgspec messages between them
(``messages``), an engine step's results as those messages (``deltas``) and the child's light entry point
(``entry``). ``inprocess_client`` speaks the same messages to an engine in the caller's own process, for the
offline API."""
