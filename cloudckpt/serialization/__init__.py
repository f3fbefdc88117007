"""The one home of unpickling: every torch.load and pickle.Unpickler allowance."""
