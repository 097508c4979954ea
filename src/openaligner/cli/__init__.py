"""The ``openaligner`` command line: one thin module per subcommand, registered in ``main``."""
