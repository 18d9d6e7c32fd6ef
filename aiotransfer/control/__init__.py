"""Control plane: the only package that imports ``zmq``."""
