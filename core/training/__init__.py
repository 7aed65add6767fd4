"""Training the learned policies with REINFORCE: decoding adapters (arXiv 2603.09065) and the fusion gate.

Nothing on the decoding path imports this package."""
