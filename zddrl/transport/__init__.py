"""Client side of the bus: the control link to the broker (``link``), the credit-paced data channel
(``channel``), chunked parameter messages (``params``) and frame I/O on sockets (``io``)."""
