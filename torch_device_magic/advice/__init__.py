"""What to do: every note, hint and piece of advice the extension gives, and the facts they
read, one module each.

The facts (they say nothing):

- `thresholds`: every threshold, the notes' and `%%profile`'s rules', in one place;
- `compiles`: torch.compile's records of what it compiled, read once for all three;
- `holders`: what keeps tensors alive that no name holds (`Out`, a traceback, autograd
  graphs, optimizer state), and letting go of it.

What says things with them:

- `notes`: the notes under the per-cell report line (`Note`, `Advisor`);
- `hints`: the hint under a classic device error's traceback;
- `profile_rules`: `%%profile`'s advice (`Advice`), one plain function a rule.

This package imports nothing of its own here, so that a module that needs one fact (the
profile's thresholds) does not load the others.
"""
