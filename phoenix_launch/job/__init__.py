"""The supervisor's job: its state (``state``), the step that changes it (``step``), the transitions the step carries
out (one file each: ``hotswap``, ``resize``, ``resync``, ``restart``, ``ladder``, ``evict``, with ``recovery`` and
``settle``), the effects it asks for (``phoenix_launch.effects``) and the interpreter that applies them (``interpret``)."""
