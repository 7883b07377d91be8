"""The worker behind both HTTP faces: sessions, queues, the operation table, the catalogue."""
