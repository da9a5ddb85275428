//! Where ranks sit along the rings and chains that algorithms pass data
//! around: the backend's [`rank_order`] (ranks that share a core next to
//! each other), or rank order. Position `p` holds rank `order[p % W]`;
//! a ring's right neighbour is the next position, its left the one before.
//!
//! [`rank_order`]: crate::backend::Capabilities::rank_order

/// The positions of a group's ranks, and this rank's.
#[derive(Clone, Copy)]
pub struct Line<'a> {
    order: Option<&'a [usize]>,
    size: usize,
    /// This rank's position.
    pub me: usize,
}

impl<'a> Line<'a> {
    /// The line of `size` ranks in `order` (`None`: rank order), seen from
    /// `rank`. An `order` that is not a permutation of the ranks is
    /// ignored.
    pub fn new(order: Option<&'a [usize]>, size: usize, rank: usize) -> Line<'a> {
        let mut line = Line { order: order.filter(|o| is_permutation(o, size)), size, me: 0 };
        line.me = line.position(rank);
        line
    }

    /// The rank at position `p` (taken modulo the group's size).
    pub fn rank(&self, p: usize) -> usize {
        let p = p % self.size;
        self.order.map_or(p, |o| o[p])
    }

    /// The position of `rank`.
    pub fn position(&self, rank: usize) -> usize {
        self.order.and_then(|o| o.iter().position(|&r| r == rank)).unwrap_or(rank)
    }

    /// The next rank along (a ring's right neighbour).
    pub fn right(&self) -> usize {
        self.rank(self.me + 1)
    }

    /// The rank before (a ring's left neighbour).
    pub fn left(&self) -> usize {
        self.rank(self.me + self.size - 1)
    }
}

fn is_permutation(order: &[usize], size: usize) -> bool {
    let mut seen = vec![false; size];
    order.len() == size && order.iter().all(|&r| r < size && !std::mem::replace(&mut seen[r], true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_follow_the_order_and_wrap() {
        let order = [0, 2, 4, 6, 1, 3, 5, 7];
        let l = Line::new(Some(&order), 8, 6);
        assert_eq!((l.me, l.left(), l.right()), (3, 4, 1));
        assert_eq!((l.rank(8 + 4), l.position(7)), (1, 7));
        let plain = Line::new(None, 8, 6);
        assert_eq!((plain.me, plain.left(), plain.right(), plain.rank(9)), (6, 5, 7, 1));
    }

    #[test]
    fn an_order_that_is_not_a_permutation_is_ignored() {
        for bad in [&[0, 1, 1][..], &[0, 1], &[0, 1, 3]] {
            let l = Line::new(Some(bad), 3, 2);
            assert_eq!((l.me, l.right(), l.left()), (2, 0, 1), "{bad:?}");
        }
    }
}
