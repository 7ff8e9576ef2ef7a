"""Helpers shared by test files: fakes, fixtures and small utilities, one module per thing.

Test files import them as ``from helpers.<module> import ...`` (pytest puts ``tests/`` on the
path); no test file imports from another (``tests/test_code_rules.py`` checks it)."""
