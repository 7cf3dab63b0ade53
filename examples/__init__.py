"""Examples of hosts embedding queryloop (not installed with the package; tested in tests/)."""
