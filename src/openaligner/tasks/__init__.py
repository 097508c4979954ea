"""Built-in tasks with programmatic scorers, used by ``openaligner demo`` and the tests."""
