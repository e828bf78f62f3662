"""The trainer: dispatcher, collector, credit assignment, advantages, losses, trainer backends."""
