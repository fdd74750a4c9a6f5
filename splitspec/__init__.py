"""splitspec: the client package (`splitspec` console command) and the generated API stubs."""
