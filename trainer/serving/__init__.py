"""The worker behind both HTTP faces, with no routes: resources and sessions (`worker`,
`lifecycle`), per-session FIFO queues (`queues`), the operation table (`operations`), request
bodies and their checks (`bodies`, `jsonparse`, `jsonscan`, `bodychild`, `requests`), responses
(`responses`), the SQLite catalogue (`catalogue`), large payloads (`payloads`) and error
bodies (`errors`).

It imports the engine and below (through `engine_protocols` where a protocol says enough);
never `trainer.api` or `trainer.distributed` (the CLI hands it the torchrun loader).
"""
