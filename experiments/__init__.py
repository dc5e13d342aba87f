"""Experiments on the runtime: bench, the designs' ladders, Edge0's ladder, routing traces and their replay, the
llama.cpp peer. They drive Sessions; nothing in the runtime imports them."""
