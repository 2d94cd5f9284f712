"""A cancel token for tests that cancels at a chosen look."""
from edgellm.engine import CancelToken


class CancelAfter(CancelToken):
    """Cancels at the k-th time the engine looks (between layers, between chunks, per token)."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    @property
    def cancelled(self):
        self.k -= 1
        return self.k < 0

    def reset(self):
        pass
