"""`kvtier` and one module per subcommand (`generate`, `plan`, `eval`, `serve`); `options` holds
the option types and the method flags, generated from the registry (`kvtier.methods`).

May import anything in kvtier; nothing imports it (the top layer).
"""
