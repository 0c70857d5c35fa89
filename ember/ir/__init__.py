"""ember's graph IR: op set, graph, symbolic sizes, views as index maps."""
