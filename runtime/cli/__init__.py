"""The `queryloop` command (`main`), its offline demo (`demo`) and the scenario-file runner
(`scenario`). The top layer: it may import every other one, and nothing imports it.
"""
