"""Goodput simulator: a discrete-event model of a large cluster under failures and stragglers, and the resilience
policies compared on it (checkpoint-restart, titan_recover's in-step recovery with quotas, with spares, Decoupled
DiLoCo). See docs/simulator.md."""
