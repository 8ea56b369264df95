"""A performance model of one engine: a step-time law fitted from measured trials and a simulation of its
scheduler, to predict the goodput of configs not yet measured."""
