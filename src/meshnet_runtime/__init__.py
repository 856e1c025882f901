"""meshnet_runtime: the anyio drivers shared by the node and the gateway.

Thin by design (docs/runtime.md): everything the wire means is decided by
``meshnet_proto``; these modules own sockets, threads, clocks and processes.
One concern per module, imported from the module that owns it:

* ``endpoints``   — ``http://``, ``https://``, ``unix:`` URLs
* ``transports``  — listen/connect on TCP, TLS, Unix sockets; memory pairs
* ``http_server`` — the serving loop (accepting, the connection cap, shutdown)
* ``application`` — the ``Application`` protocol and the replies it returns
* ``request_cycle`` — one connection's request and answer cycles (timeouts, keep-alive)
* ``client_watch`` — cancelling work for a client that left
* ``server_io``, ``server_settings``, ``server_errors`` — bytes between stream and
  connection, the server's settings, the errors the loop sends itself
* ``downstream``  — pooled keep-alive client to one downstream; ``Downstream``,
  the protocol it and ``replicas.ReplicaSet`` share
* ``sequencing``  — the waits, wake-ups and joins around the core's ``SessionTable``
* ``codec_pool``  — zstd and large copies in worker threads
* ``deadlines``   — ``X-Meshnet-Deadline-Ms`` arithmetic
* ``config``      — the flags every server takes, ``MESHNET_*`` environment (wire-2 §9)
* ``metrics``     — one Prometheus registry per server
* ``lifecycle``   — signals, ready line, logging
"""
