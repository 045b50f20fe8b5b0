"""Starting pdserve on one machine: spawn primitives (``spawn``), GPU placement (``placement``),
the restart supervisor (``supervisor``) and the ``pdserve up`` command (``up``)."""
