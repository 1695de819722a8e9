"""Built-in fault kinds for ``rlctl inject`` and the ``faults:`` config section."""
