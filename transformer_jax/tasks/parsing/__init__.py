"""§6.3 constituency parsing: treebank reading, linearized trees, EVALB, the tree constraint."""
