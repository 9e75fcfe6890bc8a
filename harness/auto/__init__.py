"""``mtpm=auto``: the candidates and the memory model, the search over them, and its two leaders measured further."""
