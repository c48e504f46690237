-- One bank partition's database (bank_a holds accounts 0-999, bank_b 1000-1999).
-- The server applies a transfer leg and records the transaction id in the same
-- SQL transaction: `applied` is the TID table that makes a replay safe.
CREATE TABLE IF NOT EXISTS accounts (
    id      integer PRIMARY KEY,
    balance bigint  NOT NULL CHECK (balance >= 0)
);
CREATE TABLE IF NOT EXISTS applied (
    tid     text    PRIMARY KEY,        -- the router's transaction id
    legs    integer NOT NULL,           -- transfer legs of this tid applied here
    delta   bigint  NOT NULL,           -- their net change to this database's money
    server  text    NOT NULL            -- which server process applied it
);
