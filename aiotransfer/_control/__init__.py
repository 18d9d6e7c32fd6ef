"""Control plane: the only package that imports ``zmq``."""

__all__: list[str] = []
