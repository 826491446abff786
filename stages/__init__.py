"""One module per pipeline stage; stages never import each other."""
