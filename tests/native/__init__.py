"""Differential tests of the compiled engine core (``kvpool_native``) against the Python one."""
