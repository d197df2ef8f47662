"""`kvtier` and one module per subcommand (`generate`, `plan`, `eval`, `serve`); `options` holds
the option types and the method flags, generated from the registry (`kvtier.methods`); the
`plan_*` modules hold `kvtier plan`'s options, its request and the plans it prints beside lossless.

May import anything in kvtier; nothing imports it (the top layer).
"""
