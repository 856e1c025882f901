"""``meshnet``: the command line (``meshnet demo``, ``meshnet send``)."""
