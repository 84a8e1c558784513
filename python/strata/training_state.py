"""Where the engine is in its loop: its phase, one value that the engine's parts check (the
hooks, the lending's and the gradients', and the optimizer step read it; the loop and the
gradient hook move it), in place of loose flags each set in one file and read in another; and
its counts, DeepSpeed's (micro-steps, global steps, skipped steps), with the accumulation window
they place a micro-batch in; and what torch's .grad would hold in a loop of one's own (the
user's zero_grad() since the last step, and which parameters a zero_grad(set_to_none=False) keeps
as zeros), which the engine refuses to differ from.

    IDLE       no gradient since the last step() (or zero_grad())
    BACKWARD   engine.backward() is running
    GRADIENTS  a backward the engine ran (or took as its own) since the last step()
    LOOSE      a gradient hook ran outside engine.backward() since the last step(): the user's
               loss.backward(), not taken as the engine's yet (engine._adopt_backward)

Thread safety: the engine's (one thread).
"""

import enum

__all__ = ["Phase", "TrainingState"]


class Phase(enum.Enum):
    IDLE = "idle"
    BACKWARD = "backward"
    GRADIENTS = "gradients"
    LOOSE = "loose gradients"


class TrainingState:
    """The engine's phase (Phase) and counts, shared by its parts."""

    __slots__ = ("phase", "accumulation", "micro_steps", "global_steps", "skipped_steps",
                 "zeroed", "zeros_kept", "graded")

    def __init__(self, accumulation=1):
        self.phase = Phase.IDLE
        self.accumulation = accumulation  # gradient_accumulation_steps
        self.micro_steps = 0  # step() calls that counted (each ends a micro-batch)
        self.global_steps = 0  # accumulation boundaries passed (skipped steps included)
        self.skipped_steps = 0  # of those, steps skipped (an fp16 overflow)
        # As torch's .grad would be in a loop of one's own: zero_grad() called since the last
        # step() (or no step yet), where a backward of the user's starts from no gradient; the
        # last zero_grad() kept gradients as zeros (set_to_none=False); and the parameters
        # (entries) given a gradient since the last zero_grad() that set them to None, which
        # torch would step while zeros are kept, with a gradient or not.
        self.zeroed = True
        self.zeros_kept = False
        self.graded = set()

    def is_boundary(self):
        """The micro-batch running now ends the accumulation window."""
        return (self.micro_steps + 1) % self.accumulation == 0

    @property
    def in_backward(self):
        """engine.backward() is running."""
        return self.phase is Phase.BACKWARD

    @property
    def backward_since_step(self):
        """A backward of the engine's ran (or runs) since the last step(): step() may take it."""
        return self.phase is Phase.BACKWARD or self.phase is Phase.GRADIENTS

    @property
    def gradients_since_step(self):
        """Any gradient was made since the last step(), by the engine's backward or another."""
        return self.phase is not Phase.IDLE

    def zero_grad(self, set_to_none):
        """The user's zero_grad(set_to_none)."""
        self.zeroed = True
        self.zeros_kept = not set_to_none
        if set_to_none:
            self.graded.clear()

    def gradient_made(self):
        """A gradient hook ran: outside the engine's backward it is the user's own."""
        if self.phase is Phase.IDLE:
            self.phase = Phase.LOOSE
