//! The parameter server's flags and exchanges: what each bit of a message's
//! `flags` means, and the exchanges a scheme's round runs on the servers
//! (`quant::scheme`). The worker writes these and the server reads them;
//! neither defines its own. The commands themselves are `message::Command`.

/// One bit of `Meta::flags`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Flag {
    /// Push payload: a 2-bit compressed array (header and blocks).
    Compressed = 1,
    /// Push: apply this push at once (dist_async).
    Async = 2,
    /// Pull response: the payload is in the code-count encoding (`counts`).
    CodeCounts = 4,
    /// Push: one exchange of a scheme, reduced over every worker and answered
    /// to each with the result. Body: `op` (an `Exchange`), `step`, `phase`.
    Exchange = 8,
    /// Push: a scheme's final contribution: summed, decoded once with the
    /// round's exchanges, then applied like any push. Body: `step`.
    Scheme = 16,
    /// Pull response: the value is a scheme's decoded sum, sent as its
    /// exchanges and summed codes (`scheme::value_to_wire`); lossless.
    SchemeValue = 32,
    /// A sync push that failed on its worker (a wrong shape, a NaN): it takes
    /// the worker's turn in the round and fails the round for every worker;
    /// the body says why.
    Abort = 64,
}

impl Flag {
    pub const fn bit(self) -> u16 {
        self as u16
    }
}

/// The reduction of one exchange of a scheme's round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    /// Elementwise maximum of float32 parts (shared scales).
    Max,
    /// Elementwise sum of float32 parts or of codes.
    Sum,
    /// Elementwise minimum of level indices (multi-scale masks).
    Min,
    /// The round's final contribution, summed as `Sum`.
    Final,
}

impl Exchange {
    /// The name on the wire (the `op` of an exchange's body).
    pub fn name(self) -> &'static str {
        match self {
            Exchange::Max => "max",
            Exchange::Sum => "sum",
            Exchange::Min => "min",
            Exchange::Final => "final",
        }
    }

    pub fn parse(name: &str) -> Option<Exchange> {
        [Exchange::Max, Exchange::Sum, Exchange::Min, Exchange::Final].into_iter().find(|e| e.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bits_are_distinct() {
        for e in [Exchange::Max, Exchange::Sum, Exchange::Min, Exchange::Final] {
            assert_eq!(Exchange::parse(e.name()), Some(e));
        }
        assert_eq!(Exchange::parse("avg"), None);
        let flags = [Flag::Compressed, Flag::Async, Flag::CodeCounts, Flag::Exchange, Flag::Scheme, Flag::SchemeValue, Flag::Abort];
        assert_eq!(flags.iter().fold(0u16, |acc, f| acc | f.bit()).count_ones() as usize, flags.len());
    }
}
