"""Built-in weight transports, registered as a third-party transport would be (``register_weight_transports``)."""
