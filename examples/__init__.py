"""q4's examples: a regular package, so that an installed package named `examples` never shadows it."""
