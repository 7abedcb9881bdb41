"""One socket: the ZeroMQ server of one model's cache, its endpoint lock, what it keeps of each
client, its stats views, and the router that fronts several models. Imports the engine and the facts."""
