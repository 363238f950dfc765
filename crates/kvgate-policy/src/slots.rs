//! The concurrency cap's slots by priority class, with reserved concurrency (`tenants.classes.
//! CLASS.reserved_concurrency`), shared by the gateway's admission and the simulator's: which
//! class may take a free slot now.
//!
//! A class's reservation is slots the classes below it may not take. Reservations nest: the
//! classes at or above `C` are guaranteed the sum of the reservations at or above `C`, and a
//! request of class `c` may take a free slot only if, for every class `C` above `c`, the slots
//! still free afterwards cover what `C` and the classes above it are guaranteed and do not hold
//! yet. A higher class may so always use a lower class's reserve, a lower class never a higher
//! one's; without reservations this is the plain cap. The rule is monotone in the class: when
//! a class may not enter, no lower class may, so the admission queue need only ask about the
//! highest class waiting.

use crate::fair::PriorityClass;

/// Slots in use per class under a cap, with each class's reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassSlots {
    limit: usize,
    /// By rank.
    reserved: [usize; 3],
    in_use: [usize; 3],
}

impl ClassSlots {
    /// `limit` slots; `reserved[rank]` of them kept from the classes below rank `rank` (the
    /// configuration checks that they add up to less than `limit`).
    pub fn new(limit: usize, reserved: [usize; 3]) -> ClassSlots {
        ClassSlots { limit, reserved, in_use: [0; 3] }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Slots held, all classes together.
    pub fn in_use(&self) -> usize {
        self.in_use.iter().sum()
    }

    /// Whether a request of `class` may take a slot now.
    pub fn may_enter(&self, class: PriorityClass) -> bool {
        let free = self.limit.saturating_sub(self.in_use());
        if free == 0 {
            return false;
        }
        // What each class above `class` (with those above it) is guaranteed and does not hold.
        let mut guaranteed = 0;
        let mut held = 0;
        let mut kept = 0;
        for rank in (class.rank() + 1..self.reserved.len()).rev() {
            guaranteed += self.reserved[rank];
            held += self.in_use[rank];
            kept = kept.max(guaranteed.saturating_sub(held));
        }
        free > kept
    }

    /// Takes a slot for `class` (whether it [`may_enter`](ClassSlots::may_enter) is the
    /// caller's check).
    pub fn enter(&mut self, class: PriorityClass) {
        self.in_use[class.rank()] += 1;
    }

    /// Frees a slot `class` held.
    pub fn leave(&mut self, class: PriorityClass) {
        let held = &mut self.in_use[class.rank()];
        debug_assert!(*held > 0, "a {} slot left that was not held", class.as_str());
        *held = held.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PriorityClass::*;

    /// Fills the slots with `class` while it may enter; returns how many it took.
    fn fill(slots: &mut ClassSlots, class: PriorityClass) -> usize {
        let mut taken = 0;
        while slots.may_enter(class) {
            slots.enter(class);
            taken += 1;
        }
        taken
    }

    #[test]
    fn without_reservations_it_is_the_plain_cap() {
        let mut slots = ClassSlots::new(4, [0; 3]);
        assert_eq!(fill(&mut slots, Low), 4);
        assert!(!slots.may_enter(High));
        slots.leave(Low);
        assert!(slots.may_enter(Low) && slots.may_enter(High));
    }

    /// The lower classes fill what is not reserved; a higher class still finds its slots, and
    /// takes the rest too.
    #[test]
    fn a_higher_class_is_admitted_while_lower_classes_fill_the_rest() {
        let mut slots = ClassSlots::new(8, [0, 2, 2]);
        assert_eq!(fill(&mut slots, Low), 4, "low leaves normal's and high's reserves");
        assert_eq!(fill(&mut slots, Normal), 2, "normal leaves high's reserve");
        assert_eq!(fill(&mut slots, High), 2);
        assert_eq!(slots.in_use(), 8);
        // High uses normal's reserve when normal does not: with normal idle, high takes 4.
        let mut slots = ClassSlots::new(8, [0, 2, 2]);
        assert_eq!(fill(&mut slots, Low), 4);
        assert_eq!(fill(&mut slots, High), 4);
        // A slot a low request frees goes to no low request while high's guarantee is unmet.
        let mut slots = ClassSlots::new(4, [0, 0, 1]);
        assert_eq!(fill(&mut slots, Normal), 3);
        slots.enter(High);
        slots.leave(High);
        assert!(!slots.may_enter(Normal) && slots.may_enter(High));
    }

    /// Whatever the mix held, the rule is monotone in the class and never exceeds the cap.
    #[test]
    fn entry_is_monotone_in_the_class_and_bounded_by_the_cap() {
        for reserved in [[0, 0, 0], [0, 1, 2], [0, 3, 0], [0, 0, 5]] {
            for held in 0..6usize.pow(3) {
                let in_use = [held % 6, held / 6 % 6, held / 36];
                let slots = ClassSlots { limit: 6, reserved, in_use };
                let may = PriorityClass::ALL.map(|class| slots.may_enter(class));
                assert!(may[0] <= may[1] && may[1] <= may[2], "{reserved:?} {in_use:?}: {may:?}");
                if slots.in_use() >= 6 {
                    assert_eq!(may, [false; 3]);
                }
            }
        }
    }
}
