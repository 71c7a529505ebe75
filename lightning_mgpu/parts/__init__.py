"""The parts the strategies are assembled from, one job each, each tested alone.

Data flows one way: presets -> settings -> strategies (assemblies) -> parts -> torch. Parts never import a
strategy; what they need (the model, the process group, the trainer, a callback) is passed to them.
"""
